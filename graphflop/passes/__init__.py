"""graphflop's passes: FLOPs, memory, optimizer update, forward-gradient and train steps, the
summary, and the JVP/VJP builders as passes (:mod:`graphflop.passes.autodiff`). Each pass is a
torch.fx ``PassBase`` with declared facts (:mod:`graphflop.passes.infra`)."""
