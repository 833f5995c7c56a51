"""The training run: the loop (`trainer`), the supervised warm start (`sft`), metrics and logging
(`metrics`) and process launch (`launch`)."""
