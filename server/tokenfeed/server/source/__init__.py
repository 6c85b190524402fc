"""Sources cut into chunks known from a listing, and one chunk's records read."""
