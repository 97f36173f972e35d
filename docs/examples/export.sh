# TensorBoard event files beside the run (RUN/grpolens/tensorboard/<run name>/)
grpolens export sample_runs/trl-tiny --to tensorboard
# again after the run grew: only the new steps are added (here: none)
grpolens export sample_runs/trl-tiny --to tensorboard --quiet
# into a shared log directory, next to the trainer's own runs
grpolens export sample_runs/trl-tiny --to tensorboard --logdir tb-logs --name trl-tiny-grpolens
