"""The model router: many models behind one API, the catalogue, the scheduler (loads, evictions, sleep), admission."""
