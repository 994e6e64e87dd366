"""One batch as the stages see it: a slot per request, the batch's record, the hooks of an
optional stage, and the dimensions of the metrics they export. Above `model/`, below the
stages' folders (`cache/`, `drift/`, `shadow/`) and the top level (docs/layout.md)."""
