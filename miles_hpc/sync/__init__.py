"""miles_hpc.sync (see DESIGN.md section 2)."""
