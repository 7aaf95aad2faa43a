"""The Hugging Face generator the demo and verl's ``composable_hf`` rollout share: one model
build, one weight sync, one sampling loop.

Design. Both callers hold a plain ``transformers`` causal LM and fill it from the engine's
``get_per_tensor_param()``; only what is theirs stays with them.

- :mod:`~engine.generation.weights`: the model built from a transformers config
  (:func:`build_model`, float32), and :class:`GeneratorWeights`, every name a sync may send
  (checkpoint names, a mixture-of-experts layer's experts one tensor each as rows of
  transformers' fused parameters, and transformers' own names) -> where it goes, a sync's
  completeness, and LoRA adapters merged as ``W + (B @ A) * alpha / r``.
- :mod:`~engine.generation.sampling`: the loop (:func:`generate`): left-padded rows, a KV
  cache passed under the one name :func:`cache_argument` picks (transformers 5's ``cache``, or
  ``past_key_values`` for an older model: the one version switch), temperature / top-k / top-p
  (:class:`Warp`), each drawn token's log-prob, stop tokens. How a token is drawn is the
  caller's object (:class:`Multinomial`, :class:`GumbelMax`, :class:`MostLikely`), so each
  caller's random streams draw what they always drew.
- :mod:`~engine.generation.routes`: the experts each position was routed to (verl's R3).

What stays with each caller: the demo's task, rewards and its all-gather of the actor's
tensors; verl's request batching, sleep / resume, request-id streams, bucketed sync protocol
(adapter halves, the first sync's base model) and its ServerAdapter / replica glue. This
package imports neither verl nor the CLI (``tests/test_layering.py``).
"""
