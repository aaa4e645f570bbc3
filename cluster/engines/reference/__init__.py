"""Reference engines, not part of the product: a paged engine over a tiny Llama with its block manager,
block pool and KV pools. They show an integration small enough to read in one sitting and drive the
examples, benchmarks and tests; production engines are vLLM (engines/vllm) and transformers (engines/hf)."""
