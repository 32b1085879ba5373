"""Generation engines implementing :class:`gym_bridge.interfaces.GenerationInterface`.

- :mod:`~gym_bridge.generation.hf`: local transformers causal LMs (CPU or GPU), continuously batched, with
  in-place weight refits;
- :mod:`~gym_bridge.generation.openai_http`: any OpenAI-compatible ``/v1/completions`` fleet (vLLM), with
  session routing (:mod:`~gym_bridge.generation.routing`) and its wire format
  (:mod:`~gym_bridge.generation.completions_wire`);
- :mod:`~gym_bridge.generation.scripted` and :mod:`~gym_bridge.generation.instant`: deterministic policies
  for tests and benchmarks; :mod:`~gym_bridge.generation.factory` picks one by name.
"""
