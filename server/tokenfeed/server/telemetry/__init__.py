"""What the server tells its operators: every metric, declared in one place, and its logs."""
