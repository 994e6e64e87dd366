"""The ground floor of handlers/: the small frozen types every layer reads (image limits, each
kind's request options, the cascade's escalation, a request as parsed and as decoded, the one
check of a fraction) and Triton's launch, compiled or interpreted, for the kernels of
`request/` and `task/`. It imports nothing else of handlers/; `request/`, `task/` and `model/`
import it (docs/layout.md)."""
