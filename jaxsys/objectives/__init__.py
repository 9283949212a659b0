"""Training objectives besides next-token cross-entropy (which lives with the model,
`transformer.token_losses`, and the program's weighted mean): `dpo` (Direct Preference
Optimization, config.train.objective='dpo'). Each states its loss on per-sequence quantities; the
program (jaxsys/program.py) computes those per shard and sums the shares."""
