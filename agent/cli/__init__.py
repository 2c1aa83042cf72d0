"""The `ncm` command: its entry point, the admin and chat commands, the demo, first boot, the planner's preview."""
