"""The tools on top of the services: the `tandem` command line (cli), `tandem serve` (serve), the
in-process generator (inprocess), `tandem bench` (bench/), `tandem load` (load), `tandem profile`
(profile, with report, trace and plot), the tiny pair (tiny) and the demo pair (demo).

The core they build on is `tandem/`; the services are `target_server/`, `draft_server/` and
`coordinator/`. Tools may import any of them; none of them imports a tool.
"""
