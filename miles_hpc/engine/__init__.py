"""miles_hpc.engine (see DESIGN.md section 2)."""
