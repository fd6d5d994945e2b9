"""Poisson stream generator: rate schedules, key distributions, Kafka producer keyed by pid."""
