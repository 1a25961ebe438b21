"""graphflop's passes: JVP, VJP (transpose), optimizer update, FLOPs, memory."""
