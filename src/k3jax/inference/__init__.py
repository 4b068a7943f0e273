"""The inference core: the one place that runs a model forward for generation. ``k3jax.decode``,
``k3jax.serve``, the AOT planner (``compile_step=serve``) and RL rollouts all use it.

programs.py        the slot cache (KDA recurrent + conv state, MLA latent rows per slot) and the
                   compiled decode / prefill / reset / copy programs over it; ``update_weights``
media_programs.py  the vision tower on a request's images and prefill chunks that splice its rows
prefix_programs.py the prefix cache's device moves (an MLA block, a KDA snapshot)
lazy.py            programs compiled on first use (``Programs.warm`` compiles them all)
sampling.py        greedy / temperature / top-k / top-p per row, bans, model and behaviour log-probs
generate.py        ``Generator`` (start, decode, continue a live slot) and the batch ``generate``
batch_prefill.py   the one-shot prompt forward of a left-padded batch (AOT prefill; a test reference)

Import the module that defines a name (``k3jax.inference.generate.generate``); this file exports
nothing.
"""
