"""The driver: elastictrain.fit and `elastictrain train`, checks before any worker starts, the run wired."""
