"""miles_hpc.rollout (see DESIGN.md section 2)."""
