"""Building the token store: a dataset's chunks planned, made and counted; the offline builds."""
