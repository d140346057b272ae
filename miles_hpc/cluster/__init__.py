"""miles_hpc.cluster (see DESIGN.md section 2)."""
