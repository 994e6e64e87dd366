"""Serve vision models with TorchServe: archives, servers, rollouts and the serving lab.

Layers, each with one job (the `handlers` package, shipped inside every archive, is separate):

- `model_descriptions`, `paths`: what models.yaml describes; where the project's files are.
- `torchserve_config`: config.properties, read and generated (`models=` from the descriptions).
- `archives`: building .mar archives (weights, ahead-of-time compilation), archive versions.
- `client`: the one HTTP client for the inference and management APIs (token keys included).
- `server_process`, `server_state`: starting and stopping TorchServe; what it reports.
- `rollout`: versioned rollouts, rollbacks and scaling that undo themselves on failure.
- `lab`: load generation, profiling, sweeps, tuning and comparisons.
- `cli`: the `torchserve-vision` command; no layer below imports it.
"""
