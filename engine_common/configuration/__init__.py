"""Settings declared once (flag, rule, wire number) and the configs made of them: batch limits,
scheduler, worker, listen addresses, device-dependent defaults."""
