"""Drift: what a model version sees and answers, counted into a reference profile's buckets."""
