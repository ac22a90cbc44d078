"""The demo: the generated tasks of `weir train --demo` (`launcher.demo.task`), the plot of a training run's
reward and throughput (`launcher.demo.plot`), and what `weir up --demo` shows on a stack
(`launcher.demo.showcase`). Only the launcher uses them; no library imports this package.
"""
