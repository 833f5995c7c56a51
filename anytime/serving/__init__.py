"""Serving a trained model as it was evaluated: the answer protocol written beside an export
(`protocol`), the export itself and its model card (`export`, `model_card`), `anytime serve` (`serve`:
vLLM's OpenAI server with a reasoning config) and the logits processor that forces the close text and
the header there (`answer_processor`, loaded by vLLM's server)."""
