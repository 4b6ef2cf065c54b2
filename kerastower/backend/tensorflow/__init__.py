"""The TensorFlow step engine: towers as `tf.distribute` replicas.

`step.py` builds the `tf.function` that pulls one batch per tower and runs
the tower step under `strategy.run`, `step_calls.py` calls it and reads
back what it ran, and `tower_scope.py` is what a tower enters (its
TowerContext, the tower rules); `gradients.py` is where the towers'
gradients are reduced (example-weighted, before clipping); `model.py` holds
TowerModel's tower steps on TensorFlow; `engine.py` the StepEngine the loop
runs them through; `tower_function.py` kt.Trainer's tower functions.
"""
