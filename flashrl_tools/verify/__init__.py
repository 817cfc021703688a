"""`flashrl verify`: reload consistency (does a weight sync land exactly?) and logprob drift
(how far does the 8-bit rollout policy sit from the BF16 trainer?)."""
