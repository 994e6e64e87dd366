"""Where the project's files are by default, relative to the directory a command runs in (the
project's root: `scripts/*.sh` change into it). Every command takes flags to point elsewhere."""

from __future__ import annotations

from pathlib import Path

MODEL_DESCRIPTIONS = Path("config/models.yaml")
MODEL_STORE = Path("model_store")
DEVELOPMENT_CONFIG = Path("config/config.properties")
PRODUCTION_CONFIG = Path("config/config.production.properties")
SERVER_CONFIGS = (DEVELOPMENT_CONFIG, PRODUCTION_CONFIG)
# Frontend logging at INFO, each line once, written off the request path (see the file).
LOG_CONFIG = Path("config/log4j2.xml")
# The same logs on standard output, for a container (`server run --log-to stdout`).
STDOUT_LOG_CONFIG = Path("config/log4j2-stdout.xml")
# The same as JSON lines (`server run --log-to json`).
JSON_LOG_CONFIG = Path("config/log4j2-json.xml")
RUN_DIR = Path(".run")
ROLLOUT_HISTORY = RUN_DIR / "rollout_history.json"
