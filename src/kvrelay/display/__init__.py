"""What kvrelay's tools show a person, shared by ``bench`` and ``tune``: progress lines on
stderr and the charts' house style."""
