"""The ground floor of handlers/: the small frozen types every layer reads (image limits, each
kind's request options, the cascade's escalation, a request as parsed and as decoded, the one
check of a fraction). It imports nothing else of handlers/; `request/`, `task/` and `model/`
import it (docs/layout.md)."""
