"""The generators of thinking traces and summaries behind one interface (`engine.RolloutEngine`): the
transformers engine (`hf`), vLLM's (`vllm`, the only package of the rollout that imports vLLM), the
streamed anytime requests they share (`streaming`), and the weight files for an engine in another
process (`weight_files`)."""
