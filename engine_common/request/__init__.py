"""What one request may ask: the sampling knobs declared once, the sampling and stopping
params (and ParamError, the error every layer raises for a bad value), and the bounds one step
diff carries for them. The bottom of engine_common: imports nothing of ours."""
