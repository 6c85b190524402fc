"""A job's data plan: versioned, amendable for future steps, one version per step fleet-wide
(docs/data-plan.md)."""
