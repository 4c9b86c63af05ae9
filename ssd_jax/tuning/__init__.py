"""Host policy for draft_len="auto": the cost model, its measurements, and the memories of a
`Tuner` (acceptance, step prices, calibrations, verdicts)."""
