"""The embedded default dataset: a latent-state synthetic cohort written as MEDS, with its oracle.

`generate(out_dir, n_patients, seed)` writes the dataset; `oracle(meds_dir, trajectories, harmonize)`
gives P(code ∈ Y | latent state at the cutoff); `realism.realism_report` (from MEDS) and
`realism.warehouse_realism` (from a built cohort and run) measure the realism bands.
The clinical content lives in `conditions.py` and is documented in docs/synthetic.md.
"""

from warehouse.synthetic.generate import GENERATOR_VERSION, generate, generation_parameters
from warehouse.synthetic.oracle import oracle

__all__ = ["GENERATOR_VERSION", "generate", "generation_parameters", "oracle"]
