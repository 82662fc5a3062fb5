"""The prepared session: validation, backend choice, symmetric memory and the NVLink path."""
