"""Load testing and benchmarks: Locust user, interactivity sweep, engine and gateway benches."""
