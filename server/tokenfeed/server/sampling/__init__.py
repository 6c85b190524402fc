"""Pure sample order: keyed bijections, mixtures, and where each row of a batch lives."""
