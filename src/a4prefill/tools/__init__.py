"""What users run rather than import: tools built on the runtime packages (which never import
this one). Each tool restores any process state it changes."""
