"""Policy learners behind one interface (`base.Learner`): plain PyTorch data parallel
(`data_parallel`), DeepSpeed ZeRO (`deepspeed_learner`), the zero-bubble pipeline
(`pipeline_learner`, `deepspeed_pipeline` and `deepspeed_stage`) and their device mesh (`mesh`);
the one PPO loop (`ppo`), checkpoints (`checkpoint`) and their export to Hugging Face folders
(`export`). `factory.build_learner` builds the one a recipe names from the registries in
`anytime.components`.
"""
