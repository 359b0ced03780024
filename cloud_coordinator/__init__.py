"""The cloud: drives rounds, aggregates cells, evaluates, keeps state; hosts the simulator and demo.

May import every other package; imports torch (through ``models``) lazily.
"""
