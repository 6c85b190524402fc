"""What operators see: metrics, the status page, logs."""
