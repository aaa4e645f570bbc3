"""DeadlineTimer on a real event loop: fires at the earliest deadline it was told of, re-arms at
what `expire` returns, and never fires after cancel."""

from __future__ import annotations

import asyncio

from transports.core.timer import DeadlineTimer


def test_it_fires_at_the_soonest_deadline_and_rearms_at_the_next() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        start = loop.time()
        later = [start + 0.06, None]   # what expire returns on each call

        def expire(now: float) -> float | None:
            fired.append(now)
            return later[len(fired) - 1]

        timer = DeadlineTimer(expire)
        timer.at_most(start + 10.0)
        timer.at_most(start + 0.02)   # sooner: re-armed
        timer.at_most(start + 5.0)    # later: ignored (expire re-arms past it if still due)
        assert timer.when == start + 0.02
        while len(fired) < 2:
            await asyncio.sleep(0.01)
        assert fired[0] >= start + 0.02 and fired[1] >= start + 0.06
        assert timer.when is None   # expire said nothing is left to wait for
        await asyncio.sleep(0.05)
        assert len(fired) == 2

    asyncio.run(main())


def test_a_cancelled_timer_never_fires() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fired: list[float] = []
        timer = DeadlineTimer(lambda now: fired.append(now) or loop.time())
        timer.at_most(loop.time() + 0.01)
        timer.cancel()
        timer.at_most(loop.time())
        await asyncio.sleep(0.05)
        assert fired == [] and timer.when is None

    asyncio.run(main())
