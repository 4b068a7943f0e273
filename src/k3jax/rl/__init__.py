"""GRPO-family reinforcement learning on verifiable rewards (docs/rl.md; issue 52).

``objectives``: group advantages and the GRPO / DAPO / Dr. GRPO / GSPO losses as pure jax functions;
``rewards``: built-in verifiers, user ``module:function`` rewards and their weighted sum;
``prompts``: prompt records from JSONL / Parquet through grain, rendered with the chat template.
The rollout loop and the ``python -m k3jax.rl`` entry point come with the inference core.
Nothing else in k3jax imports this package.
"""
