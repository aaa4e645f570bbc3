# kvfabric on a Ray GPU image: the default image of charts/kvfabric.
#
#   docker build -t ghcr.io/<you>/kvfabric:0.1.0 .
#   docker push ghcr.io/<you>/kvfabric:0.1.0
#
# torch comes from the base image and is never re-downloaded: pip installs kvfabric under a
# constraints file that pins the base image's own torch and ray, so a dependency that wanted another
# version fails the build instead of silently pulling gigabytes of CUDA wheels. The base must ship
# torch; rayproject/ray-llm images do (rayproject/ray images do not).
ARG RAY_VERSION=2.60.0
ARG BASE_IMAGE=rayproject/ray-llm:${RAY_VERSION}-py311-cu128
FROM ${BASE_IMAGE}
ARG RAY_VERSION

WORKDIR /home/ray/kvfabric
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users fabric ./fabric
COPY --chown=ray:users transports ./transports
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users examples ./examples

RUN python -c "import torch, ray; print(f'torch=={torch.__version__}'); print(f'ray=={ray.__version__}')" \
        > /tmp/base-constraints.txt \
    && grep -qx "ray==${RAY_VERSION}" /tmp/base-constraints.txt \
    && pip install --no-cache-dir --constraint /tmp/base-constraints.txt . \
    && python -c "import torch; assert f'torch=={torch.__version__}' == open('/tmp/base-constraints.txt').readline().strip()" \
    && kvfabric --help > /dev/null

ENV KVFABRIC_HOME=/var/lib/kvfabric
