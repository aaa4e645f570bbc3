"""The NodeActor and its parts: runtime, reads (local tiers, then pulls), pulls from peers, stores, stats, audit."""
