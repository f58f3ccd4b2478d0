"""The veRL test harness: runs of veRL's own trainer on a CPU with stratarl's plugins, outside the installed
package (a veRL user imports the plugins, the search tool and the compatibility checks; none of this).

    smoke            veRL's main_ppo, single turn, Stratified GRPO + SORL, on a hand-set one-layer Llama
    smoke_multiturn  the same through veRL's tool_agent loop and stratarl's search tool (--model tiny|smollm2)
    dp_check         SORL's ‖C‖ on two data-parallel ranks against one
    smollm2          the SmolLM2 tool-calling template and its tool model
    agent_model      the hand-set policy that searches, for the multi-turn runs
    verl_cpu         a CPU platform and ``hf`` rollout server for veRL (no plugin: also runs plain veRL)

Run from the checkout, in .venv-verl, with tests/verl on the path (Ray workers get it from
``smoke.pythonpath``):

    PYTHONPATH=tests/verl .venv-verl/bin/python -m harness.smoke --workdir /tmp/verl-smoke

tests/verl runs them (`make test-verl`); docs/verl.md describes each run.
"""
