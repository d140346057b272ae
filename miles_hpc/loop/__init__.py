"""miles_hpc.loop (see DESIGN.md section 2)."""
