"""The Ray-free rules of the Tune layer: who trains next and how far ahead (the member book),
cohort halving, placement, seats, readers, scouts, leaving, stops, waits, regrouping, resources.
Each is a plain class or function over values/, tested without Ray; the actors are thin adapters
over them."""
