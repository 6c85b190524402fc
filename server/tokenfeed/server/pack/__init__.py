"""Pure packing of rows (concat, best-fit) and the assembly of a plan's batches."""
