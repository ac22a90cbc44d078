"""The launcher on Ray: ``weir up --ray`` (`launcher.cluster.stack`), ``weir train --ray``
(`launcher.cluster.training`) and a multi-node Ray cluster on one machine for tests (`launcher.cluster.local`).

The Serve applications that run the roles on Ray are not here: they are roles (`services.cluster`).
"""
