"""Test support: driver and agent stand-ins, container and CRIU workload helpers, crafted manifests. No tests here."""
