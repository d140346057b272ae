"""miles_hpc.train (see DESIGN.md section 2)."""
