"""Support code shared by the test modules (not tests themselves): reference models, payload
encoders, test upstreams and fleets, thread runners. Import as ``from support.X import ...``."""
