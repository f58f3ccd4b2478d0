"""The warm start (`stratarl sft`): supervised steps that teach the protocol before RL (docs/training.md).

    stages   the stages and their cache: reading, demonstrations, the probe (``warm_start``)
    sft      the SFT optimizer loop over demonstration trajectories
    demos    demonstration trajectories rendered from synthetic questions' hops
    worlds   streams of fresh synthetic worlds: demonstration, reading and rehearsal worlds
    probe    the reading probe: greedy rollouts on a world the warm start never trains on

``warm_start`` is public as ``stratarl.trainer.warm_start``. Nothing is imported here: the task set-up
(stratarl.trainer.setup) reads the demonstrations' thoughts, and the stages import that set-up.
"""
